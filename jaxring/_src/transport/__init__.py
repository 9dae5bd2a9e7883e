"""How one step of a collective moves bytes; algorithms are written once against a transport."""
from jaxring._src.transport.groups import Group as Group
from jaxring._src.transport.xla import XlaTransport as XlaTransport
