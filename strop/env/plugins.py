"""Finding an extension by name: an entry point of a group, or a dotted Python path.

Task suites (`strop.suites`), tool sets (`strop.tools`) and tool-call parsers (`strop.tool_parsers`)
are found this way; strop's
built-ins are entry points of its own pyproject, registered exactly as a user's package registers
its own, so nothing is added to strop by editing a table inside it.
"""

import importlib
from importlib import metadata

from strop.errors import UserError


def load_object(group: str, spec: str, what: str):
    """The object `spec` names: the entry point `spec` of `group`, else the dotted path of a module
    (`package.module`) or of an attribute (`package.module:attribute` or `package.module.attribute`);
    None when `spec` is neither a registered name nor a dotted path. A dotted path that does not
    import is a `UserError`."""
    found = [ep for ep in metadata.entry_points(group=group) if ep.name == spec]
    if found:
        try:
            return found[0].load()
        except ImportError as e:  # the package behind the entry point fails to import: one line
            raise UserError(f"{what} {spec!r} (entry point {found[0].value}) cannot be imported: {e}") from None
    if "." not in spec and ":" not in spec:
        return None
    module_name, colon, attr = spec.partition(":")
    if not colon:
        try:
            return importlib.import_module(spec)  # a module is the object
        except ModuleNotFoundError as e:
            if e.name != spec:  # the module exists and fails to import, or its package is missing
                if not spec.startswith(f"{e.name}."):
                    raise UserError(f"{what} {spec!r} cannot be imported: {e}") from None
        module_name, _, attr = spec.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"{what} {spec!r} cannot be imported: {e}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UserError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}") from None
