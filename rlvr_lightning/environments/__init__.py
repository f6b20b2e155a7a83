"""Environments a model answers in, turn by turn: what one is (`base`), the multi-turn generation that runs
one (`episodes`), and the Python tool of tool-integrated reasoning (`python_tool`)."""
