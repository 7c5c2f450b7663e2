"""The Tinker SDK's protobuf messages: `tinker_sdk.proto` and the module `make proto` generates from it."""
