"""Whether and when a request is admitted: the in-flight slots and the queue for them, by
priority class (gate.py: the pure order, and its waits on the event loop)."""
