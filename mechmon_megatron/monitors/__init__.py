"""Stateful readers that turn model state into local signals (see ``monitors/base.py``)."""
