"""Helpers the test modules share, one topic a module; test modules import them from here
(`from tests.helpers.numerics import check_numerics`), never from each other. tests/README.md lists them."""
