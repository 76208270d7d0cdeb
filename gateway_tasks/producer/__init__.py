"""The producer side: validate a request, estimate its tokens, enqueue it on
its tier's queue (``Gateway``)."""

from gateway_tasks.producer.gateway import Gateway, TaskHandle, default_gateway, submit

__all__ = ["Gateway", "TaskHandle", "default_gateway", "submit"]
