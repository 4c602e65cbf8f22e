"""The swarm boundary: the only part of p2p-diloco that imports hivemind (except :mod:`.port`, the interface the peer
sees, which imports nothing of it). :class:`.swarm.Swarm` is the real swarm: a DHT with signed, schema-checked
records, and exact all-or-nothing averagers (libp2p or the direct-TCP data plane)."""
