"""LOOP's configuration: :class:`LOOPConfig` (training), :class:`EpisodeSettings` (shared with
``loop-eval``), the range every numeric key allows, and LOOP's equivalents of other trainers' keys."""

from .episode import EpisodeSettings
from .keys import HONOURED_TRAINING_ARGUMENTS, LOOP_EQUIVALENTS, unknown_key_message
from .loop_config import LOOP_OWN_KEYS, LOOPConfig
from .mappings import mapping_setting
from .output_dir import output_dir_problem
from .ranges import Range, check_ranges, range_of

__all__ = [
    "HONOURED_TRAINING_ARGUMENTS",
    "LOOP_EQUIVALENTS",
    "LOOP_OWN_KEYS",
    "EpisodeSettings",
    "LOOPConfig",
    "Range",
    "check_ranges",
    "mapping_setting",
    "output_dir_problem",
    "range_of",
    "unknown_key_message",
]
