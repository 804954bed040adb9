"""Built-in stateless tools (the policy calls them by name through the fabric)."""
