"""Weight-transfer strategies (engines/transfer/base.py describes the interface)."""
