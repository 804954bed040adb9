"""Built-in fabric functions (rewards, verifiers, tools). ``fabric`` discovers this package."""
