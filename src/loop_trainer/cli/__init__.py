"""TRL-style scripts (a parser plus ``main``), runnable with ``accelerate launch -m``."""
