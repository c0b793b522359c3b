"""One root for every error anarchon raises.

Subclasses mix in the builtin a caller would expect (``ValueError`` for a bad value, ``TypeError`` for a value of
the wrong kind, ``KeyError`` for an unknown job) and carry the structured fields a program needs to react without
parsing the message.
"""

from __future__ import annotations

from collections.abc import Iterable


class AnarchonError(Exception):
    """Base of every error anarchon raises. ``code`` is a stable identifier for programs and logs."""

    code: str = "ANARCHON_ERROR"

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled as what it is, not by calling the class with its message: the subclasses take their fields
        # (option, problem, allowed…), and an error sent to another process (a task queue, a pool) must arrive.
        return _restore, (type(self), self.args, self.__dict__)


def _restore(cls: type[AnarchonError], args: tuple[object, ...], state: dict[str, object]) -> AnarchonError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class ConfigError(AnarchonError, ValueError):
    """An option has a value that is not allowed. ``option`` names it, ``allowed`` says what would be."""

    code = "ANARCHON_CONFIG"

    def __init__(self, option: str, problem: str, allowed: str) -> None:
        self.option = option
        self.problem = problem
        self.allowed = allowed
        super().__init__(f"{option}: {problem}; allowed: {allowed}")


class ConfigTypeError(ConfigError, TypeError):
    """An option has a value of the wrong kind (a number where a string belongs, say)."""

    code = "ANARCHON_CONFIG_TYPE"


class UnknownOptionError(ConfigError, TypeError):
    """An option name that the object does not take (a typo, or a setting of another strategy)."""

    code = "ANARCHON_UNKNOWN_OPTION"

    def __init__(self, option: str, where: str, known: Iterable[str], hint: str = "") -> None:
        known_list = ", ".join(sorted(known)) or "none"
        problem = f"is not an option of {where}" + (f" ({hint})" if hint else "")
        super().__init__(option, problem, known_list)


class UnsupportedStrategyError(AnarchonError):
    """The server cannot run the configured strategy (idmp on Valkey or on Redis before 8.6)."""

    code = "ANARCHON_UNSUPPORTED_STRATEGY"

    def __init__(self, strategy: str, server: str, alternatives: Iterable[str]) -> None:
        self.strategy = strategy
        self.server = server
        self.alternatives = tuple(alternatives)
        super().__init__(
            f"strategy {strategy!r} needs Redis 8.6 or newer, but the server is {server}; "
            f"use one of {', '.join(repr(a) for a in self.alternatives)} instead"
        )


class StoreFormatError(AnarchonError):
    """The store was written by a newer anarchon whose format this version cannot read. Nothing was changed."""

    code = "ANARCHON_STORE_FORMAT"

    def __init__(self, key: str, found: str, supported: int) -> None:
        self.key = key
        self.found = found
        self.supported = supported
        if found.isdigit():
            problem = f"holds store format {found!r}, this anarchon reads format {supported} or older"
            remedy = "upgrade anarchon on this instance"
        else:
            problem = f"holds {found!r}, which is no store format anarchon writes"
            remedy = "another program may use this prefix: give anarchon a prefix of its own"
        super().__init__(f"{self.code}: {key} {problem}; {remedy} (the store was left unchanged)")


class StoreError(AnarchonError):
    """The store answered with an error, or could not be reached."""

    code = "ANARCHON_STORE"


class StoreReplyError(StoreError):
    """The server answered a command with an error reply; ``reply`` is the server's text."""

    code = "ANARCHON_STORE_REPLY"

    def __init__(self, reply: str) -> None:
        self.reply = reply
        super().__init__(reply)


class StoreUnavailableError(StoreError, ConnectionError):
    """The store could not be reached or did not answer in time; the outcome of the command is unknown."""

    code = "ANARCHON_STORE_UNAVAILABLE"


class JobNotFoundError(AnarchonError, KeyError):
    """No job of that name is registered on this scheduler."""

    code = "ANARCHON_JOB_NOT_FOUND"

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        known_list = ", ".join(sorted(known)) or "none"
        super().__init__(f"no job named {name!r}; registered jobs: {known_list}")

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class SchedulerStateError(AnarchonError, RuntimeError):
    """The scheduler was used in a state that does not allow it (``run_now`` before ``start``, say)."""

    code = "ANARCHON_SCHEDULER_STATE"
