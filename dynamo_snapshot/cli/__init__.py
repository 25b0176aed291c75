"""The `dynamo-snapshot` command line (top layer: may import everything below it)."""
