"""Discovery and lazy loading of components: entry points, a pluggy hook manager, one registry.

Read in this order: ``kinds``, ``discovery``, ``component``, ``manager``, ``registry``. Neither pluggy nor
importlib.metadata is imported until a function needs them.
"""
