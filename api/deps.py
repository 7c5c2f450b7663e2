"""What every route depends on: the Service behind the app, and the token scopes it requires.

Routers reach the service and the authenticator through `request.app.state`, so each router module
is a plain set of functions over one resource and `create_app` only assembles them.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from controller.service import Service


def get_service(request: Request) -> Service:
    return request.app.state.service


def reader(request: Request) -> None:
    request.app.state.auth.require(request, "read")


def writer(request: Request) -> None:
    request.app.state.auth.require(request, "write")


ServiceDep = Annotated[Service, Depends(get_service)]
READ = [Depends(reader)]
WRITE = [Depends(writer)]
