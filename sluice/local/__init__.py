"""`sluice up`: Redis, engines and the gateway as local processes."""
