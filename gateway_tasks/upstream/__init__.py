"""The upstream pools: the SDK call, streaming, circuit, health, failover, rescue (lua/upstream/)."""
