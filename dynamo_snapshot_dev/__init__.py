"""The dev harness: the local cluster the tests and the demo run on, and the demo itself.

Its own distribution (dev/pyproject.toml, `dynamo-snapshot-dev`): the product's images and wheel hold none
of it, and no production module imports it (an import-linter contract).
"""
