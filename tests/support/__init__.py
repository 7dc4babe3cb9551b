"""Test scaffolding (not shipped in the wheel): the offline Qwen2.5 tokenizer (``qwen``), the
synthetic AppWorld world and its generator (``appworld_world``, ``worldgen``), and the launcher of
the update driver (``driver``). Tests import it as ``support``: pytest puts ``tests/`` on
``sys.path`` (it holds ``conftest.py``, as for ``helpers``)."""
