"""The queue from enqueue to ack: both transport halves, pick, release, leases, tail drop (lua/dispatch/)."""
