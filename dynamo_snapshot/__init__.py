"""dynamo-snapshot: checkpoint a fully initialized GPU inference worker once, restore every later replica."""

__version__ = "0.1.0"
