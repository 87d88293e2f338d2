pub mod hub;
pub fn x(){}
