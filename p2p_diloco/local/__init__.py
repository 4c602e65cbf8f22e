"""A peer of several local ranks under torchrun: DDP or FSDP2 inside, rank 0 runs the round protocol, the other
ranks obey its commands (and, with ``outer.sharding = "sharded"``, keep and average their own shards)."""
