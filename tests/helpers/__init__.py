"""Helpers shared by the tests of several areas (each area's own live beside its tests, as
tests/artifact/helpers.py); fixtures are tests/conftest.py's."""
