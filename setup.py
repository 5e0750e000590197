"""For `python setup.py ...` and tools that look for a setup.py: the metadata is pyproject.toml's
(name, version, dependencies, the `flexgen-sparpr` script), read by setuptools; nothing is
repeated here."""
from setuptools import setup

setup()
