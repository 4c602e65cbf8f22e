"""The round protocol as data: the typed live record (:mod:`.records`), what peers conclude from the records
(:mod:`.consensus`), and the decisions of each moment of a round (:mod:`.rules`) with the actions they return
(:mod:`.actions`); the adaptive deadlines (:mod:`.deadlines`) and swarm-wide round targets (:mod:`.progress`).
Pure functions: no network, no torch, no clock of their own (``now`` is passed in)."""
