"""OpenEnv environments (over their client) as LOOP environments: ``from_openenv(client)``."""

from .environment import OpenEnvEnvironment, from_openenv

__all__ = ["OpenEnvEnvironment", "from_openenv"]
