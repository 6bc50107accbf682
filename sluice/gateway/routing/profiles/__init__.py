"""Profile handlers: which profiles a request runs, and their combined result."""
