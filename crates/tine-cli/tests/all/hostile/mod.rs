//! The escape suite, by class (issue 53): each class of attack a hostile
//! sandbox, image or client tried against tine, one file per class, each
//! test asserting the attack now fails in every path it could take. Root
//! only: sandboxes are real. docs/SECURITY.md names each test.

mod layers;
mod outbound;
mod privileges;
mod secrets;
mod sparse;
mod terminal;
