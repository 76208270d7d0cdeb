"""The queue from enqueue to ack: both transport halves, pick, release, leases (lua/dispatch/)."""
