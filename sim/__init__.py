"""The anarchon testbed: servers, simulator, nemeses, histories, checkers and reports."""
