"""Running the round protocol without processes: a deterministic simulation of time (:mod:`.sim`), an in-memory
swarm with injectable faults (:mod:`.fake_swarm`), a fake model (:mod:`.fake_training`), and the harness that puts
real peers on them (:mod:`.harness`). Used by the project's tests and benchmarks; never by a real peer."""
