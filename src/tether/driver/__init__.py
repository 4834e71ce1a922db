"""What a driver author imports: the turn contexts, ``CommandResult``, the scripted
drivers, and the agent tools' schemas and dispatcher (``tether.driver.tools``).

This room sits between ``tether.wire`` (which it imports) and ``tether.runtime`` (whose
worker imports it to run a turn); it never imports the runtime, the actors or the outside
faces. A context reaches its worker through ``WorkerPort`` (``_turn.py``). Everything
here is also exported by ``tether`` itself.
"""

from tether.driver import tools
from tether.driver.async_context import AsyncTurnContext, PreemptPolicy
from tether.driver.context import BaseContext, CommandResult, TurnContext
from tether.driver.scripted import AsyncScripted, Scripted

__all__ = [
    "AsyncScripted",
    "AsyncTurnContext",
    "BaseContext",
    "CommandResult",
    "PreemptPolicy",
    "Scripted",
    "TurnContext",
    "tools",
]
