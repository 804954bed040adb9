import os

# Ray (the bench baseline) writes an auth token and asks for it otherwise; tests run offline
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("POWERTOOLS_TRACE_DISABLED", "1")
