"""The environment a test hands a process it launches, as a shell would give it."""

from __future__ import annotations

import os

# A torch.distributed rendezvous and accelerate's DeepSpeed switch: a colocated vLLM engine built earlier in the test
# process sets the rendezvous and listens on MASTER_PORT, which a launched trainer would then try to listen on too.
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_DEEPSPEED")


def launch_environment(**overrides: str) -> dict[str, str]:
    """This process's environment without :data:`LAUNCH_VARIABLES`, with ``overrides`` on top."""
    environment = {name: value for name, value in os.environ.items() if name not in LAUNCH_VARIABLES}
    return {**environment, **overrides}
