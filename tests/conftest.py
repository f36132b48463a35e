try:
    from tests.juicefs_fixtures import *  # noqa: F401,F403
except ImportError:  # pragma: no cover - the JuiceFS fixtures are optional
    pass

try:
    from tests.sglang_fixtures import *  # noqa: F401,F403
except ImportError:  # pragma: no cover - the real-tier fixtures are optional
    pass
