"""Thin Ray actor shells around kvray's cores (shipped as ``kvray.actors``).

Only :mod:`kvray.launcher` applies ``ray.remote`` to these classes; the cores they wrap
never import them.
"""
