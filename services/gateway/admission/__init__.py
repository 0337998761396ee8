"""Whether and when a request is admitted: the in-flight slots and the queue for them, by
priority class (order.py: pure; gate.py: its waits on the event loop)."""
