"""The engine section's defaults that the LLM proxy also uses (its recovery, swap and rejoin
timings, and the ``hw_affinity`` key that covers every other tag).

``core.config_sections.EngineConfig`` takes its field defaults from here and so does
``ProxyState``: one place says them, and the proxy's and the engine replicas' actors, which
import the proxy, need not import the job config's pydantic models to know them (they were a
third of a second of CPU in each actor at every job start). Keep this module free of imports.
"""

#: The key of ``engine.hw_affinity`` that covers every tag not named there.
DEFAULT_AFFINITY = "default"

MAX_RESTARTS = 3
"""``engine.max_restarts``: times a crashed engine replica is restarted."""
RECOVER_TIMEOUT_S = 120.0
"""``engine.recover_timeout_s``: how long the proxy waits for a crashed replica to come back."""
SWAP_TIMEOUT_S = 600.0
"""``engine.swap_timeout_s``: how long a weight update waits for one replica's swap."""
REJOIN_FIRST_S = 30.0
"""``engine.rejoin_first_s``: the first wait before a dropped replica is tried again."""
REJOIN_MAX_S = 600.0
"""``engine.rejoin_max_s``: the longest wait between two tries of a dropped replica."""
