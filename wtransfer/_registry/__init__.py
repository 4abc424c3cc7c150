"""Discovery and lazy loading of components: entry points, a pluggy hook manager, one registry.

Read in this order: ``kinds`` (the four kinds as data), ``discovery`` (one metadata scan),
``component`` (a lazy reference), ``manager`` (the pluggy manager), ``registry`` (resolution).
This package imports neither pluggy nor importlib.metadata until a function needs them.
"""
