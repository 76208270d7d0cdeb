"""The upstream pools: the SDK call, streaming, circuit, health, failover, rescue, a task's reservation (lua/upstream/)."""
