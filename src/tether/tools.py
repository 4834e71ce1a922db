"""Tools for model function calling: ``schemas(style)`` and ``call_tool(ctx, name, args)``.

``import tether.tools`` and ``from tether.tools import schemas`` both work; the code
lives in ``tether.driver.tools``.
"""

from tether.driver.tools import *  # noqa: F403
from tether.driver.tools import __all__ as __all__
