"""The outer side of DiLoCo: the global state (theta, momentum, round, digest), the outer optimizer, the logical
shards of a sharded state, and what the wire and the reducers do to pseudo-gradients (codecs, validation and robust
aggregation). Pure torch: no network."""
