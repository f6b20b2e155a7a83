"""Environments a model answers in: the Python tool of tool-integrated reasoning (`python_tool`) and the
multi-turn generation that runs it (`episodes`)."""
