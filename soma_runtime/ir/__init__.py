"""Graph IR: tensors and nodes (graph), the op set (ops), atoms, jets, passes and plans; the Backend
interface plans run on (backend) and the tensor-parallel group collectives meet in (collective)."""
