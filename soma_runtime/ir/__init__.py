"""Graph IR: tensors and nodes (graph), the op set (ops), atoms, jets, passes and plans."""
