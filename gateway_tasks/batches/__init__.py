"""The OpenAI Batch API served by the gateway (gateway_tasks.batches.runner)."""
