"""The load-test tests' fixtures: the real router on loopback that tests/router provides (fixtures of a
sibling folder's conftest are not visible here, so they are imported by name)."""
from tests.router.conftest import router_stack, router_target  # noqa: F401
