"""Time and processes: the clock the driver waits on, process hygiene, and the harness that runs peer processes."""
