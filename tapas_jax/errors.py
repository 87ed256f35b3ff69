"""The one base class of every error tapas_jax raises on purpose.

Each error class of the package subclasses `TapasError` and keeps the built-in base
that says what kind of fault it is (`ValueError` for a bad option, trace, plan file
or budget; `ImportError` for a missing TPU compiler), so `except tapas.TapasError`
catches all of them and `except ValueError` still catches the bad-input ones.

Example:
  >>> import tapas_jax as tapas
  >>> try:
  ...   tapas.make_mesh({"data": 3})     # 8 devices
  ... except tapas.TapasError as e:
  ...   print(type(e).__name__, isinstance(e, ValueError))
  MeshError True
"""

__all__ = ["TapasError"]


class TapasError(Exception):
  """An error of tapas_jax: the message names what is wrong and how to fix it."""
