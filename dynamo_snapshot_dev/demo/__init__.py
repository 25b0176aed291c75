"""`dynamo-snapshot-demo`: the whole story on one machine (see command)."""
