"""Thin Ray actor shells around kvray's cores (shipped as ``kvray.actors``).

They are made here (:mod:`kvray.actors.placement`, and the manager by
:func:`kvray.actors.manager.make_manager`); of kvray's cores only :mod:`kvray.launcher`
imports them (docs/architecture.md, "Layering").
"""
