"""The API's routers, one module per resource; `api.app.create_app` includes them."""
