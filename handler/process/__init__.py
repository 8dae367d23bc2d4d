"""The server process: what runs around the app rather than inside a route.

``worker`` is gunicorn's worker (requests read on its event loop under a deadline, ``request_reader``), ``lifecycle``
the SIGTERM drain, ``disconnect`` the thread that cancels the generations of clients that went away, ``preflight``
the checks the master makes on the settings and the model folder before any worker starts, ``heap`` the worker's
malloc tuning and the thread that hands freed memory back to the OS.

May import: ``handler.errors``, ``handler.config``, ``handler.engine.loader`` (preflight asks which engine serves
a folder), gunicorn and the standard library. Nothing of the app (endpoints, service, server): the master imports
this room before it forks, and the workers load the app after.
"""
