"""The dynamo-snapshot controller: reconcilers on top of the generic runtime in ``runtime``."""
